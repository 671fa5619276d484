"""Test stand-ins for the int8 path (tests only)."""

from __future__ import annotations

import torch


class Unrounded:
    """A stand-in for a ``Q8Weight``: the smoothed float matrix itself, multiplied exactly."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.nbytes = w.clone(), 4 * w.numel()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.w.index_select(0, index)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ self.w.t()
        return y if out is None else out.add_(y)

"""RMSNorm, and the fused residual-add + RMSNorm used between sub-blocks (chapter 2)."""

from __future__ import annotations

import torch

from minisgl.kernel import fused_add_rms_norm, rms_norm

from .base import BaseOP


class RMSNorm(BaseOP):
    def __init__(self, size: int, eps: float) -> None:
        self.eps = eps
        self.weight = torch.empty(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RMSNormFused(RMSNorm):
    """forward(x, residual) -> (norm(x + residual), x + residual); with no residual yet
    (the first layer), the input itself becomes the residual."""

    def forward(self, x: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

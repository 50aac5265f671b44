"""Rotary position embedding with a precomputed cos/sin table (chapter 2)."""

from __future__ import annotations

import torch

from minisgl.kernel import apply_rope

from .base import StateLessOP


class RotaryEmbedding(StateLessOP):
    """Holds a [max_position, head_dim] float32 table: cos in the first half, sin in the second.
    It is built on the CPU (even while the model is built on the meta device) and moved to
    the positions' device on first use."""

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        inv_freq = 1.0 / base ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self._cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin_cache.device != positions.device:
            self._cos_sin_cache = self._cos_sin_cache.to(positions.device)
        return apply_rope(positions, q, k, self._cos_sin_cache)

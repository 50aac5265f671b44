"""Rotary position embedding with a precomputed cos/sin table (chapter 2; looked up once per
forward pass, so that graph replays look it up too, chapter 18)."""

from __future__ import annotations

import torch

from minisgl.core import forward_count
from minisgl.kernel import apply_rope_with, rope_cos_sin

from .base import StateLessOP


class RotaryEmbedding(StateLessOP):
    """Holds a [max_position, head_dim] float32 table: cos in the first half, sin in the second.
    It is built on the CPU (even while the model is built on the meta device) and moved to
    the positions' device on first use.

    One instance serves every layer, and all layers of a forward pass get the same positions
    tensor: the table rows are looked up by the first layer and reused by the others. The key
    is the tensor object and the forward pass's number: a CUDA graph (chapter 18) reuses one
    positions tensor, edited in place, for every replay, and must look it up every time."""

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        inv_freq = 1.0 / base ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self._cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self._key: tuple[torch.Tensor, int, torch.dtype] | None = None
        self._looked_up: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (positions, forward_count(), q.dtype)
        if self._key is None or self._key[0] is not positions or self._key[1:] != key[1:]:
            if self._cos_sin_cache.device != positions.device:
                self._cos_sin_cache = self._cos_sin_cache.to(positions.device)
            self._key, self._looked_up = key, rope_cos_sin(positions, self._cos_sin_cache, q.dtype)
        return apply_rope_with(q, k, *self._looked_up)

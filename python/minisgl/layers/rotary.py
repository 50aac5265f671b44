"""Rotary position embedding with a precomputed cos/sin table (chapter 2), looked up once per
forward pass so that graph replays look it up too; our kernel where it applies."""

from __future__ import annotations

import torch

from minisgl.core import forward_count
from minisgl.kernel import apply_rope_with, ours, qk_norm_rope, rope, rope_cos_sin

from .base import StateLessOP
from .norm import RMSNorm


class RotaryEmbedding(StateLessOP):
    """Holds a [max_position, head_dim] float32 table: cos in the first half, sin in the second.
    It is built on the CPU (even while the model is built on the meta device) and moved to
    the positions' device on first use.

    One instance serves every layer, and all layers of a forward pass get the same positions
    tensor: the table rows are looked up by the first layer and reused by the others. The key
    is the tensor object and the forward pass's number: a CUDA graph reuses one
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
        self._table_on(positions.device)
        if ours(q):  # one kernel, which reads its table rows itself
            return rope(positions, q, k, self._cos_sin_cache)
        key = (positions, forward_count(), q.dtype)
        if self._key is None or self._key[0] is not positions or self._key[1:] != key[1:]:
            self._key, self._looked_up = key, rope_cos_sin(positions, self._cos_sin_cache, q.dtype)
        assert self._looked_up is not None
        return apply_rope_with(q, k, *self._looked_up)

    def norm_and_rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        q_norm: RMSNorm, k_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's order: each head of q and k through its RMSNorm, then rotated. With our
        kernels that is one launch instead of three (a launch costs the host more than these
        kernels cost the GPU); the result is the same."""
        d = self._cos_sin_cache.shape[-1]
        if ours(q) and q.dim() == 2 and q_norm.eps == k_norm.eps:
            self._table_on(positions.device)
            return qk_norm_rope(positions, q, k, q_weight=q_norm.weight, k_weight=k_norm.weight,
                                eps=q_norm.eps, cos_sin_cache=self._cos_sin_cache)
        q = q_norm.forward(q.reshape(len(q), -1, d))
        k = k_norm.forward(k.reshape(len(k), -1, d))
        return self.forward(positions, q, k)

    def _table_on(self, device: torch.device) -> None:
        if self._cos_sin_cache.device != device:
            self._cos_sin_cache = self._cos_sin_cache.to(device)

"""AttentionLayer: q/k norm, RoPE, K/V into ctx.kv_cache, then ctx.attn_backend (chapter 3)."""

from __future__ import annotations

import torch

from minisgl.core import get_global_ctx

from .base import StateLessOP
from .norm import RMSNorm
from .rotary import RotaryEmbedding


class AttentionLayer(StateLessOP):
    """Takes the merged qkv [T, (Hq + 2 Hkv) * D], returns the attention output [T, Hq * D]."""

    def __init__(self, layer_id: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{num_qo_heads} q heads cannot share {num_kv_heads} kv heads")
        self.layer_id = layer_id
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self._rotary = rotary
        # q_norm / k_norm are weights of the surrounding attention block; kept private here
        self._q_norm, self._k_norm = q_norm, k_norm

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        batch = ctx.batch
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        if self._q_norm is not None and self._k_norm is not None:  # Qwen3: per-head RMSNorm
            q, k = self._rotary.norm_and_rotate(batch.positions, q, k, q_norm=self._q_norm,
                                                k_norm=self._k_norm)
        else:
            q, k = self._rotary.forward(batch.positions, q, k)
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.reshape(-1, hkv, d)
        ctx.kv_cache.store_kv(k, v, batch.out_loc, self.layer_id)
        return ctx.attn_backend.forward(q, k, v, layer_id=self.layer_id,
                                        batch=batch).view(-1, hq * d)

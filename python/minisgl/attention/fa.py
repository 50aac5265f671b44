"""The FlashAttention backend `fa` (chapter 17): FlashAttention 3 through sgl_kernel's
flash_attn_with_kvcache, reading K/V through a page table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.model_config import ModelConfig

from .base import BaseAttnBackend, BaseAttnMetadata


@dataclass
class FAMetadata(BaseAttnMetadata):
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, device: request i's queries are rows a:b of q
    cache_seqlens: torch.Tensor  # [B] int32, device: keys per request, new ones included
    page_table: torch.Tensor  # [B, max keys] int32, device: slot of each key (one-token pages)
    max_seqlen_q: int


class FlashAttentionBackend(BaseAttnBackend):
    """No plan step: the kernel reads the batch's layout from device tensors in every layer.
    The pool is seen as pages of one token, so the page table's rows are passed as they are."""

    def __init__(self, config: ModelConfig) -> None:
        try:
            from sgl_kernel.flash_attn import flash_attn_with_kvcache
        except ImportError as e:
            raise ImportError("the fa backend needs sgl-kernel (FlashAttention 3, Hopper GPUs): "
                              "pip install sgl-kernel, or choose --attn fi or torch") from e
        self.kernel = flash_attn_with_kvcache
        self.scale = config.head_dim**-0.5

    def prepare_metadata(self, batch: Batch) -> None:
        ctx = get_global_ctx()
        reqs, device = batch.padded_reqs, ctx.page_table.device
        lens = torch.tensor([[r.extend_len, r.device_len, r.table_idx] for r in reqs],
                            dtype=torch.int32, pin_memory=device.type == "cuda")
        lens = lens.to(device, non_blocking=True)
        q_lens, kv_lens, rows = lens.unbind(1)
        cu_q = torch.zeros(len(reqs) + 1, dtype=torch.int32, device=device)
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        max_kv = max(r.device_len for r in reqs)
        batch.attn_metadata = FAMetadata(cu_q, kv_lens, ctx.page_table[rows.long(), :max_kv],
                                         max(r.extend_len for r in reqs))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, FAMetadata)
        kv = get_global_ctx().kv_cache
        return self.kernel(q, kv.k_cache(layer_id).unsqueeze(1), kv.v_cache(layer_id).unsqueeze(1),
                           cache_seqlens=meta.cache_seqlens, page_table=meta.page_table,
                           cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                           softmax_scale=self.scale, causal=True)

"""The PyTorch reference backend `torch`: reads K/V through the page table (chapter 5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.core import Batch, get_global_ctx
from minisgl.models import ModelConfig

from .base import BaseAttnBackend, BaseAttnMetadata


@dataclass
class TorchMetadata(BaseAttnMetadata):
    q_starts: list[int]  # first row of each request in the flat q
    q_lens: list[int]  # its new tokens this step (extend_len)
    cached_lens: list[int]  # tokens before them; the new ones sit at positions cached_len...
    kv_slots: list[torch.Tensor]  # its slots 0..device_len-1, read from the page table
    masks: list[torch.Tensor | None]  # [q_len, S] keys each query may see; None: all of them


class TorchBackend(BaseAttnBackend):
    """Loops over requests: gather each one's K/V by slot, then causal softmax(q k^T / sqrt(D)) v
    with PyTorch's scaled_dot_product_attention (kv heads repeated for grouped-query attention).
    Simple, exact, device-agnostic: the reference the GPU backends are checked against."""

    def __init__(self, config: ModelConfig) -> None:
        self.scale = config.head_dim**-0.5
        self.group = config.num_qo_heads // config.num_kv_heads  # q heads per kv head

    def prepare_metadata(self, batch: Batch) -> None:
        """Once per batch (every layer reuses it): where each request's queries start, how many
        there are, which slots hold its keys, and which keys each query may see."""
        page_table = get_global_ctx().page_table
        meta, start = TorchMetadata([], [], [], [], []), 0
        for req in batch.padded_reqs:
            slots = page_table[req.table_idx, : req.device_len].long()
            meta.q_starts.append(start)
            meta.q_lens.append(req.extend_len)
            meta.cached_lens.append(req.cached_len)
            meta.kv_slots.append(slots)
            mask = None  # a single new token (decode) may see every key, itself included
            if req.extend_len > 1:  # query j sits at position cached_len + j
                q_pos = torch.arange(req.cached_len, req.device_len, device=slots.device)
                mask = torch.arange(req.device_len, device=slots.device)[None, :] <= q_pos[:, None]
            meta.masks.append(mask)
            start += req.extend_len
        batch.attn_metadata = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, TorchMetadata)
        ctx = get_global_ctx()
        k_cache, v_cache = ctx.kv_cache.k_cache(layer_id), ctx.kv_cache.v_cache(layer_id)
        out = torch.empty_like(q)
        for start, n, slots, mask in zip(meta.q_starts, meta.q_lens, meta.kv_slots, meta.masks):
            qi = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
            # [Hq, S, D]: this request's whole history, each kv head repeated for its q heads
            ki = k_cache[slots].transpose(0, 1).repeat_interleave(self.group, dim=0)
            vi = v_cache[slots].transpose(0, 1).repeat_interleave(self.group, dim=0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale)
            out[start : start + n] = oi.transpose(0, 1)
        return out

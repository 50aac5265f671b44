"""The PyTorch reference backend `torch` (chapter 5): one batched attention per layer, K/V read
through the page table; decode metadata in fixed buffers for graphs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minisgl.core import Batch, get_global_ctx
from minisgl.model_config import ModelConfig

from .base import BaseAttnBackend, BaseAttnMetadata

# cuDNN's attention builds a new plan for every new shape, and the padded length L changes at
# every decode step: measured on an H200, that cost 4 ms of CPU per call. The other kernels
# take any shape as it comes.
KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class TorchMetadata(BaseAttnMetadata):
    """The batch padded to B requests x Q queries x L keys, as index tensors on the device."""

    kv_slots: torch.Tensor  # [B, L] int64: KV slot of each request's key position
    mask: torch.Tensor  # [B, 1, g * Q, L]: 0 where row (h, j) of request b may see key k, else -inf
    q_index: torch.Tensor | None  # [B, Q]: row of the flat q for (b, j); None when Q == 1
    out_index: torch.Tensor | None  # [T]: row of the padded output for each flat query


class TorchBackend(BaseAttnBackend):
    """Gathers every request's K/V through the page table into one padded [B, Hkv, L, D] block
    and runs one scaled_dot_product_attention for the whole batch, with a length-and-causal
    mask. Grouped-query attention folds each kv head's q heads into the query axis, so the
    kv heads are never repeated. Exact and device-agnostic: the reference for the GPU backends."""

    def __init__(self, config: ModelConfig) -> None:
        self.scale = config.head_dim**-0.5
        self.num_kv_heads = config.num_kv_heads
        self.group = config.num_qo_heads // config.num_kv_heads  # q heads per kv head

    def prepare_metadata(self, batch: Batch) -> None:
        """Once per batch (every layer reuses it): one small host-to-device copy of the
        per-request lengths, then tensor ops only (no loop over tokens, no sync)."""
        ctx = get_global_ctx()
        page_table, dtype = ctx.page_table, ctx.kv_cache.k_cache(0).dtype
        device, reqs = page_table.device, batch.padded_reqs
        q_max = max(req.extend_len for req in reqs)
        kv_max = max(req.device_len for req in reqs)
        lens = torch.tensor([[req.extend_len, req.cached_len, req.table_idx] for req in reqs],
                            dtype=torch.int64, pin_memory=device.type == "cuda")
        lens = lens.to(device, non_blocking=True)
        q_lens, cached_lens, rows = lens.unbind(1)
        key_pos = torch.arange(kv_max, device=device)
        key_ok = key_pos[None, :] < (cached_lens + q_lens)[:, None]  # [B, L]
        # Padding keys are masked, but 0 * NaN is still NaN: they must read a slot that holds
        # real numbers (an unwritten slot of the pool may hold anything), so each request's
        # padding repeats its own first slot, written before any attention runs.
        table = page_table[rows, :kv_max].long()
        kv_slots = torch.where(key_ok, table, table[:, :1])
        if q_max == 1:  # decode: one query per request, which sees all of its keys
            mask = _additive(key_ok[:, None, None, :], dtype)
            batch.attn_metadata = TorchMetadata(kv_slots, mask, None, None)
            return
        j = torch.arange(q_max, device=device)
        q_pos = cached_lens[:, None] + j[None, :]  # [B, Q]: query j sits at cached_len + j
        mask = key_ok[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, L]
        starts = torch.cumsum(q_lens, 0) - q_lens  # first flat row of each request
        q_index = torch.where(j[None, :] < q_lens[:, None], starts[:, None] + j[None, :], 0)
        num_tokens = sum(req.extend_len for req in reqs)
        owner = torch.repeat_interleave(torch.arange(len(reqs), device=device), q_lens,
                                        output_size=num_tokens)  # request of each flat row
        out_index = owner * q_max + torch.arange(num_tokens, device=device) - starts[owner]
        mask = _additive(mask[:, None].repeat(1, 1, self.group, 1), dtype)  # rows follow (g, Q)
        batch.attn_metadata = TorchMetadata(kv_slots, mask, q_index, out_index)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, TorchMetadata)
        ctx = get_global_ctx()
        num_qo_heads, head_dim = q.shape[1], q.shape[2]
        b, hkv, g = meta.kv_slots.shape[0], self.num_kv_heads, self.group
        # [B, Hkv, L, D]: each request's whole history, padded to the longest
        keys = _gather(ctx.kv_cache.k_cache(layer_id), meta.kv_slots).transpose(1, 2)
        values = _gather(ctx.kv_cache.v_cache(layer_id), meta.kv_slots).transpose(1, 2)
        padded = (q.view(b, 1, num_qo_heads, head_dim) if meta.q_index is None
                  else _gather(q, meta.q_index))
        q_len = padded.shape[1]
        # q head h belongs to kv head h // g: [B, Q, Hkv, g, D] -> [B, Hkv, g * Q, D]
        queries = padded.view(b, q_len, hkv, g, head_dim).permute(0, 2, 3, 1, 4)
        with sdpa_kernel(KERNELS):
            out = F.scaled_dot_product_attention(queries.reshape(b, hkv, g * q_len, head_dim),
                                                 keys, values, attn_mask=meta.mask,
                                                 scale=self.scale)
        # back to [B * Q, Hq, D], then keep the real queries in the flat order
        out = out.view(b, hkv, g, q_len, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(b * q_len, num_qo_heads, head_dim)
        return out if meta.out_index is None else out.index_select(0, meta.out_index)


    # graph hooks: decode metadata padded to the table's width, in fixed buffers
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        ctx = get_global_ctx()
        device, max_bs = ctx.page_table.device, max(bs_list)
        self.graph_slots = torch.zeros(max_bs, max_seq_len, dtype=torch.int64, device=device)
        self.graph_mask = torch.zeros(max_bs, 1, 1, max_seq_len, dtype=ctx.kv_cache.dtype,
                                      device=device)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.prepare_metadata(batch)
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        """Copies the batch's [B, L] metadata into the buffers' first L columns; the columns
        after L repeat each request's first slot and are masked, as padding is in eager mode.
        A graph reads all max_seq_len columns in every step: exact, but it costs reads."""
        meta, bs = batch.attn_metadata, batch.padded_size
        assert isinstance(meta, TorchMetadata) and meta.q_index is None, "decode batches only"
        n = meta.kv_slots.shape[1]
        slots, mask = self.graph_slots[:bs], self.graph_mask[:bs]
        slots[:, :n].copy_(meta.kv_slots)
        slots[:, n:].copy_(meta.kv_slots[:, :1])
        mask[..., :n].copy_(meta.mask)
        mask[..., n:].fill_(float("-inf"))
        batch.attn_metadata = TorchMetadata(slots, mask, None, None)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as the additive one SDPA would otherwise build from it in every layer:
    0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] for an index of any shape; index_select is several times faster than
    advanced indexing on the CPU."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])

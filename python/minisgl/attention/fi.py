"""The FlashInfer backend `fi` (chapter 17): paged prefill and decode kernels, planned once per
batch; decode wrappers with fixed buffers for CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.model_config import ModelConfig
from minisgl.utils.device import create_event

from .base import BaseAttnBackend, BaseAttnMetadata

WORKSPACE_BYTES = 128 << 20  # FlashInfer's split-KV scratch: the size its documentation advises
# up to this many requests a batch's key slots are copied row by row (one launch; the host's
# cost grows with the rows); past it, by a gather whose dozen launches do not grow
FEW_REQS = 8


@dataclass
class FIMetadata(BaseAttnMetadata):
    """A batch in FlashInfer's terms, with every page one token long: request i's queries are
    rows qo_indptr[i]:qo_indptr[i + 1] of q, its keys the slots
    kv_indices[kv_indptr[i]:kv_indptr[i + 1]] of the pool."""

    qo_indptr: torch.Tensor  # [B + 1] int32, host (pinned on CUDA)
    kv_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indices: torch.Tensor  # [sum of kv lengths] int32, device
    last_page_len: torch.Tensor  # [B] int32, host: all ones, as every page holds one token
    wrapper: Any  # the prefill or decode wrapper; a graph's own decode wrapper on replay
    planned: bool = False


class FlashInferBackend(BaseAttnBackend):
    """The pool's slots are pages of one token for FlashInfer, whatever the scheduler's page
    size: the page table already holds slots, so no index is ever divided. `plan` (which copies
    the batch's layout to the GPU and chooses the work split) runs once per batch, in the first
    layer's forward on the engine's stream; every layer then only calls `run`."""

    def __init__(self, config: ModelConfig) -> None:
        import flashinfer  # an ImportError here names the package to install

        self.flashinfer = flashinfer
        ctx = get_global_ctx()
        device = self.device = ctx.kv_cache.device
        self.dtype = ctx.kv_cache.dtype  # of q and of the cache alike
        self.num_qo_heads, self.num_kv_heads = config.num_qo_heads, config.num_kv_heads
        self.head_dim, self.scale = config.head_dim, config.head_dim**-0.5
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # fa2, as the official: its "auto" picks fa3 on Hopper, so both engines run the same
        # prefill kernels when the two are compared
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                      backend="fa2")
        # tensor cores pay off once several q heads share a kv head (FlashInfer's own advice)
        self.tensor_cores = self.num_qo_heads // self.num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores)
        self.graph_wrappers: dict[int, Any] = {}  # one per captured batch size
        self.layer_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # views, by layer
        self.pin = device.type == "cuda"
        # plan stages the layout in one pinned host buffer of FlashInfer's and copies it to the
        # GPU asynchronously; the next plan may refill that buffer only once the copy has run
        self.plan_copied = create_event(device)
        self.plan_copied.record()

    def prepare_metadata(self, batch: Batch) -> None:
        """The indptrs stay on the host (plan reads them there); the slot indices are gathered
        on the device from one small copy of the lengths, so nothing here waits for the GPU."""
        ctx = get_global_ctx()
        reqs, device = batch.padded_reqs, ctx.page_table.device
        lens = torch.tensor([[r.extend_len, r.device_len, r.table_idx] for r in reqs],
                            dtype=torch.int32, pin_memory=self.pin)
        qo_indptr, kv_indptr = _indptr(lens[:, 0], self.pin), _indptr(lens[:, 1], self.pin)
        if len(reqs) <= FEW_REQS:  # one copy of views of the rows (a copy: the table may be
            # rewritten before the kernels read it, e.g. when a prompt's pages join the cache)
            kv_indices = torch.cat([ctx.page_table[r.table_idx, : r.device_len] for r in reqs])
        else:  # a fixed number of launches, however many rows
            total = int(kv_indptr[-1])
            kv_lens, rows = lens.to(device, non_blocking=True)[:, 1:].long().unbind(1)
            # key j of request i is at page_table[row_i, j]
            owner = torch.repeat_interleave(torch.arange(len(reqs), device=device), kv_lens,
                                            output_size=total)
            col = (torch.arange(total, device=device)
                   - (torch.cumsum(kv_lens, 0) - kv_lens)[owner])
            kv_indices = ctx.page_table[rows[owner], col]
        ones = torch.ones(len(reqs), dtype=torch.int32, pin_memory=self.pin)
        batch.attn_metadata = FIMetadata(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, last_page_len=ones,
            wrapper=self.decode if batch.is_decode else self.prefill)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, FIMetadata)
        ctx = get_global_ctx()
        if not meta.planned:
            self._plan(meta)
        if (cache := self.layer_caches.get(layer_id)) is None:  # made once per layer
            cache = self.layer_caches[layer_id] = (  # [slots, 1, Hkv, D]: NHD pages of one
                ctx.kv_cache.k_cache(layer_id).unsqueeze(1),
                ctx.kv_cache.v_cache(layer_id).unsqueeze(1))
        return meta.wrapper.run(q, cache)

    def _plan(self, meta: FIMetadata) -> None:
        self.plan_copied.synchronize()
        common = dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                      page_size=1, sm_scale=self.scale, q_data_type=self.dtype,
                      kv_data_type=self.dtype)
        if meta.wrapper is self.prefill:
            self.prefill.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                              meta.last_page_len, head_dim_qk=self.head_dim, causal=True,
                              **common)
        else:  # the eager decode wrapper, or a graph's
            meta.wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.last_page_len,
                              head_dim=self.head_dim, **common)
        self.plan_copied.record()
        meta.planned = True

    # graph hooks: a decode wrapper per batch size, over fixed device buffers
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        max_bs, i32, dev = max(bs_list), torch.int32, self.device
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=i32, device=dev)
        self.graph_indices = torch.zeros(max_bs * max_seq_len, dtype=i32, device=dev)
        self.graph_last_page_len = torch.ones(max_bs, dtype=i32, device=dev)

    def prepare_for_capture(self, batch: Batch) -> None:
        bs = batch.padded_size
        self.graph_wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=self.graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self.graph_indices,
            paged_kv_last_page_len_buffer=self.graph_last_page_len[:bs])
        self.prepare_metadata(batch)
        self.prepare_for_replay(batch)  # plan before capture: plan is host work, never captured

    def prepare_for_replay(self, batch: Batch) -> None:
        """Plan with the size's graph wrapper: in graph mode, plan copies the batch's layout
        into the fixed buffers that the captured kernels read."""
        meta = batch.attn_metadata
        assert isinstance(meta, FIMetadata)
        meta.wrapper = self.graph_wrappers[batch.padded_size]
        self._plan(meta)


def _indptr(lengths: torch.Tensor, pin: bool) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32 on the host."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, pin_memory=pin)
    torch.cumsum(lengths, 0, out=out[1:])
    return out

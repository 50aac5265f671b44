"""MHAKVCache: one buffer [2, layers, pages, page_size, kv_heads, head_dim] (chapter 4)."""

from __future__ import annotations

import torch

from minisgl.kernel import store_cache

from .base import BaseKVCachePool


class MHAKVCache(BaseKVCachePool):
    def __init__(self, num_kv_heads: int, num_layers: int, head_dim: int, num_pages: int,
                 page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self._buffer = torch.empty((2, num_layers, num_pages, page_size, num_kv_heads, head_dim),
                                   dtype=dtype, device=device)
        self._num_layers = num_layers
        # the same memory seen as flat token slots: [layers, pages * page_size, kv_heads, D]
        self._slots = self._buffer.view(2, num_layers, num_pages * page_size, num_kv_heads,
                                        head_dim)

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self._slots[0, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._slots[1, layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        store_cache(self.k_cache(layer_id), self.v_cache(layer_id), indices=out_loc, k=k, v=v)

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_slots(self) -> int:
        return self._slots.shape[2]

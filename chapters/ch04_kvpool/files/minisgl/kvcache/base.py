"""The KV cache pool interface (chapter 4)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseKVCachePool(ABC):
    """Per-layer K and V storage addressed by flat token slots (page * page_size + offset)."""

    @abstractmethod
    def k_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def v_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        """Write k[i], v[i] ([T, kv_heads, head_dim]) into slot out_loc[i] of `layer_id`."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

"""KV cache: the paged pool (chapter 4); prefix caches arrive in chapter 9."""

from __future__ import annotations

import torch

from minisgl.models import ModelConfig

from .base import BaseKVCachePool
from .mha_pool import MHAKVCache


def create_kvcache_pool(model_config: ModelConfig, num_pages: int, page_size: int,
                        device: torch.device, dtype: torch.dtype) -> BaseKVCachePool:
    return MHAKVCache(model_config.num_kv_heads, model_config.num_layers, model_config.head_dim,
                      num_pages, page_size, dtype, device)


__all__ = ["BaseKVCachePool", "MHAKVCache", "create_kvcache_pool"]

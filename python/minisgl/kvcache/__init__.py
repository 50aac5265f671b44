"""KV cache (chapter 4): the paged pool and the prefix caches, radix and naive."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.model_config import ModelConfig
from minisgl.utils.registry import Registry

from .base import BaseCacheHandle, BaseKVCachePool, BasePrefixCache, InsertResult, SizeInfo
from .mha_pool import MHAKVCache

PREFIX_CACHES: Registry[Callable[[int, torch.device], BasePrefixCache]] = Registry("cache type")


@PREFIX_CACHES.register("radix")
def _create_radix(page_size: int, device: torch.device) -> BasePrefixCache:
    from .radix_cache import RadixPrefixCache

    return RadixPrefixCache(page_size, device)


@PREFIX_CACHES.register("naive")
def _create_naive(page_size: int, device: torch.device) -> BasePrefixCache:
    from .naive_cache import NaivePrefixCache

    return NaivePrefixCache(page_size, device)


def create_kvcache_pool(model_config: ModelConfig, num_pages: int, page_size: int,
                        device: torch.device, dtype: torch.dtype) -> BaseKVCachePool:
    return MHAKVCache(num_kv_heads=model_config.num_kv_heads, num_layers=model_config.num_layers,
                      head_dim=model_config.head_dim, num_pages=num_pages, page_size=page_size,
                      dtype=dtype, device=device)


def create_prefix_cache(cache_type: str, page_size: int, device: torch.device) -> BasePrefixCache:
    return PREFIX_CACHES[cache_type](page_size, device)


__all__ = ["PREFIX_CACHES", "BaseCacheHandle", "BaseKVCachePool", "BasePrefixCache",
           "InsertResult", "MHAKVCache", "SizeInfo", "create_kvcache_pool", "create_prefix_cache"]
